// Returns a tuple value as the single function result (probe: does the plugin accept it?).
module @tuple_result {
  func.func public @main(%a: tensor<2xf32>, %b: tensor<3xi32>) -> tuple<tensor<2xf32>, tensor<3xi32>> {
    %t = stablehlo.tuple %a, %b : tuple<tensor<2xf32>, tensor<3xi32>>
    return %t : tuple<tensor<2xf32>, tensor<3xi32>>
  }
}
