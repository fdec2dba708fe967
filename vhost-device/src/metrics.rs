//! Skeleton.
pub struct Metrics {}
impl Metrics {
    /// Prometheus text exposition of every counter.
    pub fn render(&self) -> String {
        String::new()
    }
}
