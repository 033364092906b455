// u64: returns (a, a + b) for two [2,3] arrays of ui64 (addition wraps).
module @dtype_u64 {
  func.func public @main(%a: tensor<2x3xui64>, %b: tensor<2x3xui64>) -> (tensor<2x3xui64>, tensor<2x3xui64>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xui64>
    return %a, %sum : tensor<2x3xui64>, tensor<2x3xui64>
  }
}
