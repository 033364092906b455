// pred: returns (a, not a, a and b, a or b) for two [2,3] arrays of i1.
module @dtype_pred {
  func.func public @main(%a: tensor<2x3xi1>, %b: tensor<2x3xi1>) -> (tensor<2x3xi1>, tensor<2x3xi1>, tensor<2x3xi1>, tensor<2x3xi1>) {
    %not = stablehlo.not %a : tensor<2x3xi1>
    %and = stablehlo.and %a, %b : tensor<2x3xi1>
    %or = stablehlo.or %a, %b : tensor<2x3xi1>
    return %a, %not, %and, %or : tensor<2x3xi1>, tensor<2x3xi1>, tensor<2x3xi1>, tensor<2x3xi1>
  }
}
