//! Reading a VM's console log: the init prints `DMLC-START <nonce>` before
//! the job and `DMLC-EXIT <nonce> <status>` after it.

/// Finds the job's start and exit lines for `nonce` in a console log.
/// Returns (started, exit status).
pub(crate) fn scan_console(console: &str, nonce: &str) -> (bool, Option<i32>) {
    let start = format!("DMLC-START {nonce}");
    let exit = format!("DMLC-EXIT {nonce} ");
    let mut started = false;
    for line in console.lines() {
        let line = line.trim_end_matches('\r');
        if line.trim() == start {
            started = true;
        }
        // Kernel messages may share the line; match anywhere in it.
        if let Some(pos) = line.find(&exit) {
            let rest = &line[pos + exit.len()..];
            let digits: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '-')
                .collect();
            if let Ok(status) = digits.parse() {
                return (started, Some(status));
            }
        }
    }
    (started, None)
}

/// The job's output: console lines strictly between the start and exit lines.
pub(crate) fn job_output(console: &str, nonce: &str) -> String {
    let start = format!("DMLC-START {nonce}");
    let exit = format!("DMLC-EXIT {nonce} ");
    let mut lines = Vec::new();
    let mut inside = false;
    for line in console.lines() {
        let line = line.trim_end_matches('\r');
        if !inside {
            inside = line.trim() == start;
            continue;
        }
        if line.contains(&exit) {
            break;
        }
        lines.push(line);
    }
    // Drop the newline the init prints before the exit line.
    if lines.last() == Some(&"") {
        lines.pop();
    }
    lines.iter().map(|l| format!("{l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_scan_finds_only_our_nonce() {
        let log = "boot\r\nDMLC-START n1\r\nhello\r\nDMLC-EXIT other 0\r\n\r\nDMLC-EXIT n1 3\r\n";
        assert_eq!(scan_console(log, "n1"), (true, Some(3)));
        assert_eq!(scan_console(log, "n2"), (false, None));
        assert_eq!(job_output(log, "n1"), "hello\nDMLC-EXIT other 0\n");
    }

    #[test]
    fn console_scan_tolerates_kernel_text_on_the_line() {
        let log = "DMLC-START x\n[ 1.0] msg DMLC-EXIT x 0\n";
        assert_eq!(scan_console(log, "x"), (true, Some(0)));
        assert_eq!(scan_console("DMLC-EXIT x \n", "x"), (false, None));
    }
}
