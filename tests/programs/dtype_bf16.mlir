// bf16: returns (a, a + b, -a) for two [2,3] arrays of bf16.
module @dtype_bf16 {
  func.func public @main(%a: tensor<2x3xbf16>, %b: tensor<2x3xbf16>) -> (tensor<2x3xbf16>, tensor<2x3xbf16>, tensor<2x3xbf16>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xbf16>
    %neg = stablehlo.negate %a : tensor<2x3xbf16>
    return %a, %sum, %neg : tensor<2x3xbf16>, tensor<2x3xbf16>, tensor<2x3xbf16>
  }
}
