// s8: returns (a, a + b, -a) for two [2,3] arrays of i8.
module @dtype_s8 {
  func.func public @main(%a: tensor<2x3xi8>, %b: tensor<2x3xi8>) -> (tensor<2x3xi8>, tensor<2x3xi8>, tensor<2x3xi8>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xi8>
    %neg = stablehlo.negate %a : tensor<2x3xi8>
    return %a, %sum, %neg : tensor<2x3xi8>, tensor<2x3xi8>, tensor<2x3xi8>
  }
}
