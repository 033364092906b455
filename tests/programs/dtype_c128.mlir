// c128: returns (a, a + b, -a) for two [2,3] arrays of complex<f64>.
module @dtype_c128 {
  func.func public @main(%a: tensor<2x3xcomplex<f64>>, %b: tensor<2x3xcomplex<f64>>) -> (tensor<2x3xcomplex<f64>>, tensor<2x3xcomplex<f64>>, tensor<2x3xcomplex<f64>>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xcomplex<f64>>
    %neg = stablehlo.negate %a : tensor<2x3xcomplex<f64>>
    return %a, %sum, %neg : tensor<2x3xcomplex<f64>>, tensor<2x3xcomplex<f64>>, tensor<2x3xcomplex<f64>>
  }
}
