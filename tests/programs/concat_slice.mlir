// c = concatenate(a: f32[2,3], b: f32[1,3]) along dim 0 : f32[3,3];
// s = c[1:3, 0:3:2] : f32[2,2].
module @concat_slice {
  func.func public @main(%a: tensor<2x3xf32>, %b: tensor<1x3xf32>) -> (tensor<3x3xf32>, tensor<2x2xf32>) {
    %c = stablehlo.concatenate %a, %b, dim = 0 : (tensor<2x3xf32>, tensor<1x3xf32>) -> tensor<3x3xf32>
    %s = stablehlo.slice %c [1:3, 0:3:2] : (tensor<3x3xf32>) -> tensor<2x2xf32>
    return %c, %s : tensor<3x3xf32>, tensor<2x2xf32>
  }
}
