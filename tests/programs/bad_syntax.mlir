// Does not parse: an unknown op and a missing type.
module @bad_syntax {
  func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {
    %x = stablehlo.frobnicate %a
    return %x : tensor<2xf32>
  }
}
