//! mm-agent: the replication sidecar that runs beside one PostgreSQL node.

use std::process::ExitCode;

fn main() -> ExitCode {
    mm_agent::daemon::main(
        "mm-agent",
        "mm multi-master replication agent",
        mm_agent::conflict::ResolverRegistry::builtin(),
    )
}
