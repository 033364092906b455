// x @ w + b for x: f32[2,3], w: f32[3,4], b: f32[4] (broadcast along rows).
module @matmul_bias {
  func.func public @main(%x: tensor<2x3xf32>, %w: tensor<3x4xf32>, %b: tensor<4xf32>) -> tensor<2x4xf32> {
    %xw = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
    %bb = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32>
    %y = stablehlo.add %xw, %bb : tensor<2x4xf32>
    return %y : tensor<2x4xf32>
  }
}
