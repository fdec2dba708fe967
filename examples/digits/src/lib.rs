//! Data-parallel training on the handwritten-digits data set, the training
//! example of virtio-dmlc: softmax regression or a multilayer perceptron.
//!
//! [`data`] reads the CSV that scikit-learn ships, [`model`] holds the two
//! models (layout, loss, gradient, update; the MLP's passes are in `mlp`),
//! [`train`] runs data-parallel gradient descent over any
//! [`train::Collective`] and checks the result, [`local`] plays N ranks
//! with threads (tests), [`report`] writes the JSON summary. The binary `dmlc-train-digits` runs it over the rabit-style API
//! of `dmlc-comm` (see examples/README.md).

pub mod data;
pub mod local;
mod mlp;
pub mod model;
pub mod report;
pub mod train;
