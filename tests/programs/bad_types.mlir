// Parses but fails verification: add of f32[2] and f32[3].
module @bad_types {
  func.func public @main(%a: tensor<2xf32>, %b: tensor<3xf32>) -> tensor<2xf32> {
    %x = stablehlo.add %a, %b : (tensor<2xf32>, tensor<3xf32>) -> tensor<2xf32>
    return %x : tensor<2xf32>
  }
}
