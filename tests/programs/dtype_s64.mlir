// s64: returns (a, a + b, -a) for two [2,3] arrays of i64.
module @dtype_s64 {
  func.func public @main(%a: tensor<2x3xi64>, %b: tensor<2x3xi64>) -> (tensor<2x3xi64>, tensor<2x3xi64>, tensor<2x3xi64>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xi64>
    %neg = stablehlo.negate %a : tensor<2x3xi64>
    return %a, %sum, %neg : tensor<2x3xi64>, tensor<2x3xi64>, tensor<2x3xi64>
  }
}
