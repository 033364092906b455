// f16: returns (a, a + b, -a) for two [2,3] arrays of f16.
module @dtype_f16 {
  func.func public @main(%a: tensor<2x3xf16>, %b: tensor<2x3xf16>) -> (tensor<2x3xf16>, tensor<2x3xf16>, tensor<2x3xf16>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xf16>
    %neg = stablehlo.negate %a : tensor<2x3xf16>
    return %a, %sum, %neg : tensor<2x3xf16>, tensor<2x3xf16>, tensor<2x3xf16>
  }
}
