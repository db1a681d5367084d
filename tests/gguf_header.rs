//! pensieve's own GGUF header reader (candle's refuses any tensor type it does not know, as
//! MXFP4): it reads a real file's header as candle's reader does, and a header cut short
//! anywhere, or with bytes overwritten, is a typed error, never a panic or a huge allocation.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Cursor;

use candle_core::quantized::gguf_file;
use pensieve::model::{default_model_path, GgufHeader};
use pensieve::Error;

fn smollm2() -> Vec<u8> {
    std::fs::read(default_model_path()).expect("run scripts/fetch-assets")
}

#[test]
fn a_real_header_reads_as_candle_reads_it() {
    let bytes = smollm2();
    let ours = GgufHeader::read(&mut Cursor::new(&bytes)).unwrap();
    let theirs = gguf_file::Content::read(&mut Cursor::new(&bytes)).unwrap();
    assert!(ours.others.is_empty());
    let c = &ours.content;
    assert_eq!(c.tensor_data_offset, theirs.tensor_data_offset);
    assert_eq!(c.metadata.len(), theirs.metadata.len());
    for (key, value) in &theirs.metadata {
        assert_eq!(
            format!("{:?}", c.metadata[key]),
            format!("{value:?}"),
            "{key}"
        );
    }
    assert_eq!(c.tensor_infos.len(), theirs.tensor_infos.len());
    for (name, t) in &theirs.tensor_infos {
        let o = &c.tensor_infos[name];
        assert_eq!(
            (o.ggml_dtype, o.shape.dims(), o.offset),
            (t.ggml_dtype, t.shape.dims(), t.offset),
            "{name}"
        );
    }
}

#[test]
fn a_header_cut_short_or_overwritten_is_a_typed_error() {
    let bytes = smollm2();
    let end = GgufHeader::read(&mut Cursor::new(&bytes))
        .unwrap()
        .content
        .tensor_data_offset as usize;
    for cut in (0..end).step_by(end / 199) {
        let r = GgufHeader::read(&mut Cursor::new(&bytes[..cut]));
        assert!(matches!(r, Err(Error::InvalidModel { .. })), "cut at {cut}");
    }
    // Lengths, counts, value types and text overwritten: read or refused, nothing else.
    let head = &bytes[..end + 4096];
    for at in (4..end).step_by(end / 211) {
        for fill in [0xFF, 0x7F, 0x00] {
            let mut b = head.to_vec();
            b[at..at + 8].fill(fill);
            let r = GgufHeader::read(&mut Cursor::new(&b));
            assert!(
                matches!(r, Ok(_) | Err(Error::InvalidModel { .. })),
                "{fill:#x} at {at}: {r:?}"
            );
        }
    }
}
