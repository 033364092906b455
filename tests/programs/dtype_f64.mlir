// f64: returns (a, a + b, -a) for two [2,3] arrays of f64.
module @dtype_f64 {
  func.func public @main(%a: tensor<2x3xf64>, %b: tensor<2x3xf64>) -> (tensor<2x3xf64>, tensor<2x3xf64>, tensor<2x3xf64>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xf64>
    %neg = stablehlo.negate %a : tensor<2x3xf64>
    return %a, %sum, %neg : tensor<2x3xf64>, tensor<2x3xf64>, tensor<2x3xf64>
  }
}
