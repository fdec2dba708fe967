//! `dmlc-guest`: device information, self-test, benchmark and a local
//! multi-rank launcher for the virtio-dmlc allreduce device.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
