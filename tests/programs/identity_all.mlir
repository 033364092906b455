// Identity over all 15 XLA element types at once: result i is parameter i, in the order
// PRED S8 S16 S32 S64 U8 U16 U32 U64 F16 BF16 F32 F64 C64 C128.
module @identity_all {
  func.func public @main(%p0: tensor<2x3xi1>, %p1: tensor<2x3xi8>, %p2: tensor<2x3xi16>, %p3: tensor<2x3xi32>, %p4: tensor<2x3xi64>, %p5: tensor<2x3xui8>, %p6: tensor<2x3xui16>, %p7: tensor<2x3xui32>, %p8: tensor<2x3xui64>, %p9: tensor<2x3xf16>, %p10: tensor<2x3xbf16>, %p11: tensor<2x3xf32>, %p12: tensor<2x3xf64>, %p13: tensor<2x3xcomplex<f32>>, %p14: tensor<2x3xcomplex<f64>>) -> (tensor<2x3xi1>, tensor<2x3xi8>, tensor<2x3xi16>, tensor<2x3xi32>, tensor<2x3xi64>, tensor<2x3xui8>, tensor<2x3xui16>, tensor<2x3xui32>, tensor<2x3xui64>, tensor<2x3xf16>, tensor<2x3xbf16>, tensor<2x3xf32>, tensor<2x3xf64>, tensor<2x3xcomplex<f32>>, tensor<2x3xcomplex<f64>>) {
    return %p0, %p1, %p2, %p3, %p4, %p5, %p6, %p7, %p8, %p9, %p10, %p11, %p12, %p13, %p14 : tensor<2x3xi1>, tensor<2x3xi8>, tensor<2x3xi16>, tensor<2x3xi32>, tensor<2x3xi64>, tensor<2x3xui8>, tensor<2x3xui16>, tensor<2x3xui32>, tensor<2x3xui64>, tensor<2x3xf16>, tensor<2x3xbf16>, tensor<2x3xf32>, tensor<2x3xf64>, tensor<2x3xcomplex<f32>>, tensor<2x3xcomplex<f64>>
  }
}
