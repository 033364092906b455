// s32: returns (a, a + b, -a) for two [2,3] arrays of i32.
module @dtype_s32 {
  func.func public @main(%a: tensor<2x3xi32>, %b: tensor<2x3xi32>) -> (tensor<2x3xi32>, tensor<2x3xi32>, tensor<2x3xi32>) {
    %sum = stablehlo.add %a, %b : tensor<2x3xi32>
    %neg = stablehlo.negate %a : tensor<2x3xi32>
    return %a, %sum, %neg : tensor<2x3xi32>, tensor<2x3xi32>, tensor<2x3xi32>
  }
}
