module @sharded attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<8x3xf32> {mhlo.sharding = "{devices=[4,1]<=[4]}"}, %b: tensor<8x3xf32> {mhlo.sharding = "{replicated}"}) -> (tensor<8x3xf32> {mhlo.sharding = "{devices=[4,1]<=[4]}"}, tensor<f32> {mhlo.sharding = "{replicated}"}) {
    %0 = stablehlo.add %a, %b : tensor<8x3xf32>
    %cst = stablehlo.constant dense<0.0> : tensor<f32>
    %1 = stablehlo.reduce(%a init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x3xf32>, tensor<f32>) -> tensor<f32>
    return %0, %1 : tensor<8x3xf32>, tensor<f32>
  }
}
