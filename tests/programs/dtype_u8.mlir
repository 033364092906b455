// u8: returns (a, a + b) for two [2,3] arrays of ui8 (addition wraps).
module @dtype_u8 {
  func.func public @main(%a: tensor<2x3xui8>, %b: tensor<2x3xui8>) -> (tensor<2x3xui8>, tensor<2x3xui8>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xui8>
    return %a, %sum : tensor<2x3xui8>, tensor<2x3xui8>
  }
}
