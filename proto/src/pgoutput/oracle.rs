//! The codec's correctness oracle, shared by the cargo-fuzz target
//! (`proto/fuzz`) and the seed-corpus test so both check the same properties.
//!
//! Input format: one context selector byte (see [`context_from_selector`])
//! followed by one pgoutput message.
//!
//! Properties, for the selected context and every other context alike:
//! decoding never panics; and when it succeeds, re-encoding gives back the
//! exact input bytes (the format has one encoding per message: flags,
//! markers and lengths are all validated) and decoding those gives the same
//! message.

use bytes::Bytes;

use super::{DecodeContext, decode, encode_to_bytes};

/// Every context a selector byte can name: protocol 1..=4 x in/out of a
/// stream block x parallel streaming, including the combinations PostgreSQL
/// cannot produce (decode must reject those cleanly).
pub fn all_contexts() -> impl Iterator<Item = DecodeContext> {
    (0u8..16).map(context_from_selector)
}

/// Bits 0-1: protocol version - 1; bit 2: in a stream block; bit 3: parallel
/// streaming. Higher bits are ignored.
pub fn context_from_selector(selector: u8) -> DecodeContext {
    DecodeContext {
        protocol_version: (selector & 0b11) + 1,
        in_stream_block: selector & 0b100 != 0,
        parallel_streaming: selector & 0b1000 != 0,
    }
}

/// The inverse of [`context_from_selector`] (protocol versions 1..=4 only).
pub fn selector_for(ctx: &DecodeContext) -> u8 {
    (ctx.protocol_version.saturating_sub(1) & 0b11)
        | (u8::from(ctx.in_stream_block) << 2)
        | (u8::from(ctx.parallel_streaming) << 3)
}

/// What [`check`] observed for one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// The message decoded under the context named by the selector byte.
    pub selected_decoded: bool,
    /// Number of contexts (of 16) under which it decoded.
    pub decoded_in: usize,
}

/// Runs the oracle on `input`. `Err` describes a violated property (the
/// fuzz target turns it into a crash).
pub fn check(input: &[u8]) -> Result<Outcome, String> {
    let Some((&selector, message)) = input.split_first() else {
        return Ok(Outcome::default());
    };
    let selected = context_from_selector(selector);
    let payload = Bytes::copy_from_slice(message);
    let mut outcome = Outcome::default();
    for ctx in all_contexts() {
        let decoded = match decode(payload.clone(), &ctx) {
            Ok(m) => m,
            Err(e) => {
                // Formatting errors must not panic either.
                let _ = e.to_string();
                continue;
            }
        };
        outcome.decoded_in += 1;
        if ctx == selected {
            outcome.selected_decoded = true;
        }
        let encoded = encode_to_bytes(&decoded, &ctx)
            .map_err(|e| format!("{ctx:?}: decoded {decoded:?} but encoding it failed: {e}"))?;
        if encoded != payload {
            return Err(format!(
                "{ctx:?}: re-encoding {decoded:?} gave {encoded:02x?}, input was {payload:02x?}"
            ));
        }
        let again = decode(encoded, &ctx)
            .map_err(|e| format!("{ctx:?}: re-decoding the encoding of {decoded:?} failed: {e}"))?;
        if again != decoded {
            return Err(format!(
                "{ctx:?}: decoded {decoded:?}, round trip gave {again:?}"
            ));
        }
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selector_round_trips() {
        for s in 0u8..16 {
            assert_eq!(selector_for(&context_from_selector(s)), s);
        }
    }
}
