//! Ids nobody can guess: 128 bits from the operating system's random source, as hex after a
//! prefix that says what the id names (`resp_`, `conv_`, `msg_`, `chatcmpl-`). An id of a
//! stored response or conversation is what opens it, so a guessable one (a hash of the time
//! and a counter) would hand it to whoever guesses.

use axum::http::StatusCode;

use super::error::ApiError;

/// A new id: `prefix` then 32 hex digits of fresh randomness.
///
/// # Errors
/// A 500 when the operating system gives no randomness (nothing is made without it).
pub fn random_id(prefix: &str) -> Result<String, ApiError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("no randomness for an id: {e}"),
        )
    })?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{prefix}{hex}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_hex_of_128_bits_and_differ() {
        let a = random_id("resp_").map_err(|e| e.message);
        let b = random_id("resp_").map_err(|e| e.message);
        let (Ok(a), Ok(b)) = (a, b) else {
            panic!("no randomness");
        };
        assert_eq!(a.len(), 5 + 32);
        assert!(a[5..].chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
