// c64: returns (a, a + b, -a) for two [2,3] arrays of complex<f32>.
module @dtype_c64 {
  func.func public @main(%a: tensor<2x3xcomplex<f32>>, %b: tensor<2x3xcomplex<f32>>) -> (tensor<2x3xcomplex<f32>>, tensor<2x3xcomplex<f32>>, tensor<2x3xcomplex<f32>>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xcomplex<f32>>
    %neg = stablehlo.negate %a : tensor<2x3xcomplex<f32>>
    return %a, %sum, %neg : tensor<2x3xcomplex<f32>>, tensor<2x3xcomplex<f32>>, tensor<2x3xcomplex<f32>>
  }
}
