// Row sums (over dim 1 -> s32[3]) and column sums (over dim 0 -> s32[4]) of a: s32[3,4];
// the second uses the generic region form of stablehlo.reduce.
module @reduce_sum_s32 {
  func.func public @main(%a: tensor<3x4xi32>) -> (tensor<3xi32>, tensor<4xi32>) {
    %zero = stablehlo.constant dense<0> : tensor<i32>
    %rows = stablehlo.reduce(%a init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<3x4xi32>, tensor<i32>) -> tensor<3xi32>
    %cols = "stablehlo.reduce"(%a, %zero) ({
      ^bb0(%x: tensor<i32>, %y: tensor<i32>):
        %s = stablehlo.add %x, %y : tensor<i32>
        stablehlo.return %s : tensor<i32>
    }) {dimensions = array<i64: 0>} : (tensor<3x4xi32>, tensor<i32>) -> tensor<4xi32>
    return %rows, %cols : tensor<3xi32>, tensor<4xi32>
  }
}
