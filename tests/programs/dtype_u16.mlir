// u16: returns (a, a + b) for two [2,3] arrays of ui16 (addition wraps).
module @dtype_u16 {
  func.func public @main(%a: tensor<2x3xui16>, %b: tensor<2x3xui16>) -> (tensor<2x3xui16>, tensor<2x3xui16>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xui16>
    return %a, %sum : tensor<2x3xui16>, tensor<2x3xui16>
  }
}
