// Converts f32[6] to s32 (truncation toward zero), bf16 and f16 (round to nearest even).
module @convert {
  func.func public @main(%a: tensor<6xf32>) -> (tensor<6xi32>, tensor<6xbf16>, tensor<6xf16>) {
    %i = stablehlo.convert %a : (tensor<6xf32>) -> tensor<6xi32>
    %b = stablehlo.convert %a : (tensor<6xf32>) -> tensor<6xbf16>
    %h = stablehlo.convert %a : (tensor<6xf32>) -> tensor<6xf16>
    return %i, %b, %h : tensor<6xi32>, tensor<6xbf16>, tensor<6xf16>
  }
}
