// No parameters: iota along dim 1 as s32[2,3] and along dim 0 as f32[4,2].
module @iota {
  func.func public @main() -> (tensor<2x3xi32>, tensor<4x2xf32>) {
    %a = stablehlo.iota dim = 1 : tensor<2x3xi32>
    %b = stablehlo.iota dim = 0 : tensor<4x2xf32>
    return %a, %b : tensor<2x3xi32>, tensor<4x2xf32>
  }
}
