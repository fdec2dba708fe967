//! The Chrome trace event format, as Perfetto's JSON importer reads it: a
//! check of the flight recorder's dumps (`vhost-device-dmlc --trace-out`)
//! shared by the backend's tests and the launcher's VM tests.

use std::collections::BTreeMap;

use serde_json::Value;

/// Checks `trace` against the Chrome trace event format as Perfetto's
/// JSON importer reads it; returns the X events by (pid, tid).
pub fn check(trace: &Value) -> BTreeMap<(u64, u64), Vec<Value>> {
    let events = trace["traceEvents"].as_array().expect("traceEvents array");
    assert!(!events.is_empty());
    let mut slices: BTreeMap<(u64, u64), Vec<Value>> = BTreeMap::new();
    for e in events {
        let ph = e["ph"].as_str().expect("ph");
        assert!(e["name"].is_string(), "{e}");
        let pid = e["pid"].as_u64().expect("pid");
        let tid = e["tid"].as_u64().expect("tid");
        match ph {
            "M" => {
                let what = e["name"].as_str().unwrap();
                assert!(
                    ["process_name", "thread_name", "process_sort_index"].contains(&what),
                    "{e}"
                );
                assert!(e["args"].is_object());
            }
            "X" => {
                let ts = e["ts"].as_f64().expect("ts");
                let dur = e["dur"].as_f64().expect("dur");
                assert!(ts >= 0.0 && dur >= 0.0, "{e}");
                assert!(e["cat"].is_string() && e["args"].is_object(), "{e}");
                slices.entry((pid, tid)).or_default().push(e.clone());
            }
            other => panic!("unexpected phase {other}: {e}"),
        }
    }
    // The slices of one thread nest or follow each other.
    for (track, list) in &mut slices {
        list.sort_by(|a, b| {
            a["ts"]
                .as_f64()
                .unwrap()
                .total_cmp(&b["ts"].as_f64().unwrap())
        });
        let mut open: Vec<f64> = Vec::new();
        for e in list.iter() {
            let ts = e["ts"].as_f64().unwrap();
            let end = ts + e["dur"].as_f64().unwrap();
            while open.last().is_some_and(|&o| o <= ts + 1e-3) {
                open.pop();
            }
            if let Some(&outer) = open.last() {
                assert!(end <= outer + 1e-3, "slices overlap on {track:?}: {e}");
            }
            open.push(end);
        }
    }
    slices
}
