//! Data-parallel softmax regression on the handwritten-digits data set, the
//! training example of virtio-dmlc.
//!
//! [`data`] reads the CSV that scikit-learn ships, [`model`] is the softmax
//! regression (loss, gradient, update), [`train`] runs data-parallel
//! gradient descent over any [`train::Collective`] and checks the result,
//! [`local`] plays N ranks with threads (tests), [`report`] writes the JSON
//! summary. The binary `dmlc-train-digits` runs it over the rabit-style API
//! of `dmlc-comm` (see examples/README.md).

pub mod data;
pub mod local;
pub mod model;
pub mod report;
pub mod train;
