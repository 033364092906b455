//! A model served by `tpubox serve` whose inference is a wasi-nn graph: at its first `infer`
//! the instance loads `/model/graph.onnx` (its model directory, preopened by the daemon) with
//! wasi-nn's `load` (encoding `onnx`), or, when `/model/graph.name` exists, the repository's
//! model of that name with `load-by-name`; it makes one execution context and keeps both, and
//! every request then computes through that context.
//!
//! Metadata: input `INPUT` `FP32` `[4]`, output `OUTPUT` `FP32` `[3]`, `max-batch-size` 0 (a
//! request's tensor is `[4]`, given to the graph as its input `x` `[1, 4]`; the graph's output
//! `y` `[1, 3]` is returned as `[3]`). `tests/wasi-nn/test_serve.py` writes the graph.

use std::cell::RefCell;

use tpubox_guest::model::{
    Datatype, Model, ModelMetadata, TensorData, TensorMetadata, WitError, input,
};
use tpubox_guest::{Error, ErrorKind};

mod nn {
    wit_bindgen::generate!({
        path: "../../../wit/wasi-nn",
        world: "ml",
    });
}

use nn::wasi::nn::graph::{ExecutionTarget, Graph, GraphEncoding, load, load_by_name};
use nn::wasi::nn::inference::GraphExecutionContext;
use nn::wasi::nn::tensor::{Tensor, TensorType};

thread_local! {
    /// The graph and its context, loaded at the first request.
    static LOADED: RefCell<Option<(Graph, GraphExecutionContext)>> = const { RefCell::new(None) };
}

fn nn_error(what: &str, e: nn::wasi::nn::errors::Error) -> WitError {
    Error::new(
        ErrorKind::Internal,
        format!("{what}: {:?}: {}", e.code(), e.data()),
    )
    .into()
}

struct NnModel;

impl Model for NnModel {
    fn metadata() -> ModelMetadata {
        ModelMetadata {
            inputs: vec![TensorMetadata::new("INPUT", Datatype::Fp32, &[4])],
            outputs: vec![TensorMetadata::new("OUTPUT", Datatype::Fp32, &[3])],
            max_batch_size: 0,
        }
    }

    fn infer(inputs: Vec<TensorData>) -> Result<Vec<TensorData>, WitError> {
        let x = input(&inputs, "INPUT")?;
        LOADED.with(|cell| {
            let mut loaded = cell.borrow_mut();
            if loaded.is_none() {
                let graph = match std::fs::read_to_string("/model/graph.name") {
                    // A model of the repository, by its name.
                    Ok(name) => {
                        load_by_name(name.trim()).map_err(|e| nn_error("load-by-name", e))?
                    }
                    Err(_) => {
                        let bytes = std::fs::read("/model/graph.onnx").map_err(|e| {
                            WitError::from(Error::new(
                                ErrorKind::Internal,
                                format!("/model/graph.onnx: {e}"),
                            ))
                        })?;
                        load(&[bytes], GraphEncoding::Onnx, ExecutionTarget::Tpu)
                            .map_err(|e| nn_error("load", e))?
                    }
                };
                let ctx = graph
                    .init_execution_context()
                    .map_err(|e| nn_error("init-execution-context", e))?;
                *loaded = Some((graph, ctx));
            }
            let (_, ctx) = loaded.as_ref().expect("loaded above");
            let t = Tensor::new(&[1, 4], TensorType::Fp32, &x.data);
            let outs = ctx
                .compute(vec![("x".to_string(), t)])
                .map_err(|e| nn_error("compute", e))?;
            let (_, y) = outs
                .into_iter()
                .find(|(n, _)| n == "y")
                .ok_or_else(|| WitError::from(Error::new(ErrorKind::Internal, "no output y")))?;
            Ok(vec![TensorData {
                name: "OUTPUT".into(),
                datatype: Datatype::Fp32,
                shape: vec![3],
                data: y.data(),
            }])
        })
    }
}

tpubox_guest::export_model!(NnModel);
