// u32: returns (a, a + b) for two [2,3] arrays of ui32 (addition wraps).
module @dtype_u32 {
  func.func public @main(%a: tensor<2x3xui32>, %b: tensor<2x3xui32>) -> (tensor<2x3xui32>, tensor<2x3xui32>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xui32>
    return %a, %sum : tensor<2x3xui32>, tensor<2x3xui32>
  }
}
