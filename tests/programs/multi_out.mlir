// Four results of different dtypes and ranks from one f32[2,3] argument:
// (scalar sum of a : f32[], a zero-size slice : f32[0,3], iota along dim 0 : s64[3,2],
//  a * a computed in f64 : f64[2,3]).
module @multi_out {
  func.func public @main(%a: tensor<2x3xf32>) -> (tensor<f32>, tensor<0x3xf32>, tensor<3x2xi64>, tensor<2x3xf64>) {
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %sum = stablehlo.reduce(%a init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<2x3xf32>, tensor<f32>) -> tensor<f32>
    %empty = stablehlo.slice %a [0:0, 0:3] : (tensor<2x3xf32>) -> tensor<0x3xf32>
    %iota = stablehlo.iota dim = 0 : tensor<3x2xi64>
    %wide = stablehlo.convert %a : (tensor<2x3xf32>) -> tensor<2x3xf64>
    %sq = stablehlo.multiply %wide, %wide : tensor<2x3xf64>
    return %sum, %empty, %iota, %sq : tensor<f32>, tensor<0x3xf32>, tensor<3x2xi64>, tensor<2x3xf64>
  }
}
