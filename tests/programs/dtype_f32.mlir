// f32: returns (a, a + b, -a) for two [2,3] arrays of f32.
module @dtype_f32 {
  func.func public @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xf32>
    %neg = stablehlo.negate %a : tensor<2x3xf32>
    return %a, %sum, %neg : tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>
  }
}
