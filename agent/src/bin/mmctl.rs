//! mmctl: the operator's CLI for an mm cluster. The code lives in
//! `mm_agent::ctl` so it can be tested as a library.

fn main() -> std::process::ExitCode {
    mm_agent::ctl::main()
}
