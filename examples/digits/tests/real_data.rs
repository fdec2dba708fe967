//! Training on the real digits data with ranks as threads: the data loads as
//! expected, every N gives bitwise identical ranks and matches the
//! single-process model within the tolerance, and the model learns.

mod common;

use std::thread;

use dmlc_example_digits::data::{self, CLASSES, FEATURES, SAMPLES};
use dmlc_example_digits::local::Threads;
use dmlc_example_digits::model::Model;
use dmlc_example_digits::train::{train, Settings, Single, DEFAULT_TOLERANCE};

#[test]
fn loads_scikit_learns_digits() {
    let d = data::load(&common::data_path()).unwrap();
    assert_eq!(d.len(), SAMPLES);
    assert_eq!((d.features, d.classes), (FEATURES, CLASSES));
    // Every digit occurs about 180 times.
    for c in 0..CLASSES as u8 {
        let k = d.y.iter().filter(|&&y| y == c).count();
        assert!((170..=190).contains(&k), "digit {c}: {k} samples");
    }
    // The first image is a 0, as in scikit-learn's load_digits().
    assert_eq!(d.y[0], 0);
    assert_eq!(
        &d.row(0)[..8],
        &[
            0.0,
            0.0,
            5.0 / 16.0,
            13.0 / 16.0,
            9.0 / 16.0,
            1.0 / 16.0,
            0.0,
            0.0
        ]
    );
    let (train_set, test_set) = d.split(data::DEFAULT_TEST_SIZE).unwrap();
    assert_eq!((train_set.len(), test_set.len()), (1500, 297));
}

fn distributed(n: u32, settings: &Settings, d: &data::Dataset) -> Vec<Model> {
    let handles: Vec<_> = Threads::group(n)
        .into_iter()
        .map(|mut c| {
            let (s, d) = (settings.clone(), d.clone());
            thread::spawn(move || train(&mut c, &s, &d, |_| {}).unwrap().model)
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn any_rank_count_matches_the_single_process_model() {
    let d = data::load(&common::data_path()).unwrap();
    let (train_set, test_set) = d.split(data::DEFAULT_TEST_SIZE).unwrap();
    for batch in [0, 128] {
        let settings = Settings {
            batch,
            ..Settings::default()
        };
        let single = train(&mut Single, &settings, &train_set, |_| {}).unwrap();
        let acc = single.model.correct(&test_set) as f64 / test_set.len() as f64;
        println!("batch {batch}: single-process test accuracy {acc:.4}");
        assert!(acc >= 0.85, "test accuracy {acc}");
        for n in [2, 3, 4, 7] {
            let models = distributed(n, &settings, &train_set);
            for m in &models[1..] {
                assert_eq!(m.params, models[0].params, "n={n}: ranks differ");
            }
            let diff = single.model.max_abs_diff(&models[0]);
            println!("batch {batch} n {n}: max abs diff {diff:e}");
            assert!(diff <= DEFAULT_TOLERANCE, "n={n}: diff {diff}");
        }
    }
}
