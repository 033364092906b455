// mask = a > b (float compare); result = select(mask, a, b), i.e. elementwise max.
module @compare_select {
  func.func public @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> (tensor<2x3xi1>, tensor<2x3xf32>) {
    %m = stablehlo.compare GT, %a, %b, FLOAT : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xi1>
    %s = stablehlo.select %m, %a, %b : tensor<2x3xi1>, tensor<2x3xf32>
    return %m, %s : tensor<2x3xi1>, tensor<2x3xf32>
  }
}
