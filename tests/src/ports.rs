use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// A currently free TCP port on 127.0.0.1.
///
/// The kernel picks it (bind to port 0), so parallel test processes rarely
/// collide; the port is free only until someone else binds it, so callers
/// that start servers retry on "address in use". Ports already handed out
/// by this process are never repeated, so two nodes of one test cannot get
/// the same port even if the first has not bound it yet.
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    loop {
        let port = match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
            Ok(addr) => addr.port(),
            Err(e) => panic!("cannot bind 127.0.0.1:0 to find a free port: {e}"),
        };
        let mut guard = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
        if guard.get_or_insert_with(HashSet::new).insert(port) {
            return port;
        }
    }
}
