// s16: returns (a, a + b, -a) for two [2,3] arrays of i16.
module @dtype_s16 {
  func.func public @main(%a: tensor<2x3xi16>, %b: tensor<2x3xi16>) -> (tensor<2x3xi16>, tensor<2x3xi16>, tensor<2x3xi16>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xi16>
    %neg = stablehlo.negate %a : tensor<2x3xi16>
    return %a, %sum, %neg : tensor<2x3xi16>, tensor<2x3xi16>, tensor<2x3xi16>
  }
}
