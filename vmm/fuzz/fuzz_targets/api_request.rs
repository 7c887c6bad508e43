//! Arbitrary bytes as one API request line, through the daemon's parser
//! (`k7d_api::api::parse_request`: envelope, version, op, each op's
//! arguments and their validation), the first thing every client byte meets.
//!
//! Invariants: no panic, no hang; a line the parser accepts is written back
//! by the client's own serializer (`request_line`) as a line that parses to
//! the same request (what the CLI sends is what the daemon reads).

#![no_main]

use k7d_api::api::{parse_request, request_line};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(req) = parse_request(line) else {
        return;
    };
    let again = match request_line(&req) {
        Ok(l) => l,
        Err(e) => panic!("an accepted request does not serialize: {e}: {line:?}"),
    };
    match parse_request(&again) {
        Ok(back) => assert_eq!(back, req, "round trip changed the request: {line:?} -> {again:?}"),
        Err(e) => panic!("the client's line for an accepted request is refused: {e:?}: {line:?} -> {again:?}"),
    }
});
