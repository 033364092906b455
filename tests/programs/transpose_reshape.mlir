// a: s32[2,3] -> (transpose : s32[3,2], reshape : s32[3,2], reshape : s32[6]).
module @transpose_reshape {
  func.func public @main(%a: tensor<2x3xi32>) -> (tensor<3x2xi32>, tensor<3x2xi32>, tensor<6xi32>) {
    %t = stablehlo.transpose %a, dims = [1, 0] : (tensor<2x3xi32>) -> tensor<3x2xi32>
    %r = stablehlo.reshape %a : (tensor<2x3xi32>) -> tensor<3x2xi32>
    %f = stablehlo.reshape %a : (tensor<2x3xi32>) -> tensor<6xi32>
    return %t, %r, %f : tensor<3x2xi32>, tensor<3x2xi32>, tensor<6xi32>
  }
}
