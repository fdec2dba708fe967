//! vhost-device-dmlc: the vhost-user backend daemon of the virtio-dmlc device.

use std::error::Error;
use std::process::ExitCode;

use clap::Parser;
use vhost_device_dmlc::config::{Args, Config};
use vhost_device_dmlc::daemon::start_backend;

fn main() -> ExitCode {
    let args = Args::parse();
    env_logger::Builder::new()
        .filter_level(args.log_level.into())
        .format_timestamp_millis()
        .init();
    let result = Config::try_from(args)
        .map_err(Box::<dyn Error>::from)
        .and_then(|config| start_backend(config).map_err(Box::<dyn Error>::from));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", dmlc_cli_support::error_text(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
