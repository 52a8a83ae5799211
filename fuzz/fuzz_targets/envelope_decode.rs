//! Bytes as a message body through the envelope decoder the runtime uses. What decodes must
//! keep the decoder's promises: its payload parses, its idempotency key is never blank unless
//! its id is, and encoding it decodes to the same envelope.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::envelope::{Envelope, is_blank};

fuzz_target!(|data: &[u8]| {
    let Ok(envelope) = Envelope::decode(data) else { return };
    let payload = envelope.payload_value().expect("a decoded envelope's payload parses");
    assert!(!envelope.id.is_empty());
    let key = envelope.idempotency_key();
    assert!(!is_blank(key) || key == envelope.id, "blank key {key:?} that is not the id");

    let encoded = envelope.encode();
    let again = Envelope::decode(&encoded).expect("an encoded envelope decodes");
    assert_eq!(again.id, envelope.id);
    assert_eq!(again.kind, envelope.kind);
    assert_eq!(again.version, envelope.version);
    assert_eq!(again.occurred_at, envelope.occurred_at);
    assert_eq!(again.idempotency_key, envelope.idempotency_key);
    assert_eq!(again.payload.get(), envelope.payload.get());
    assert_eq!(again.payload_value().expect("parses"), payload);
});
