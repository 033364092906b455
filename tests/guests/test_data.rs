//! Inputs shared by the test guests (`tests/guests/graph-ops`, `tests/guests/eager`) and the
//! tests that check them (`tests/all/graph.rs`, `tests/all/eager.rs`), included by each with
//! `#[path]`, so that both sides compute the same f32 values. Expected values are computed by
//! the tests, never here.

/// `n` values in [-2, 2) on a grid of 4/23, scrambled by `seed`.
pub fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i * 37 + seed * 11) % 23) as f32 * (4.0 / 23.0) - 2.0)
        .collect()
}

/// `n` values in [0.25, 2.25): [`data`]'s magnitudes, shifted.
pub fn pos(n: usize, seed: u32) -> Vec<f32> {
    data(n, seed).iter().map(|x| x.abs() + 0.25).collect()
}
