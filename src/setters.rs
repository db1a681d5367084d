//! Chained setters for the public configuration types.
//!
//! Those types are `#[non_exhaustive]` so that a field can be added without breaking hosts;
//! outside the crate they are built from `Default` (or a named constructor) and these setters,
//! one per field, named like the field. Each field is given a mode:
//! - `value`: the setter takes the field's type;
//! - `into`: the setter takes anything that converts into it (`String`, `PathBuf`);
//! - `some`: the field is an `Option`; the setter takes a value, `Some(value)` or `None`;
//! - `fill`: the field is an `Option` the setter fills with a value of its inner type (for
//!   trait objects, which a conversion would not coerce);
//! - `some_into`: the field is an `Option` the setter fills with anything that converts into
//!   its inner type (clear it by assigning `None` to the field).

/// `setters!(Type { mode field: FieldType, ... })` writes the setters of `Type`.
macro_rules! setters {
    ($ty:ident { $($mode:ident $field:ident: $t:ty),* $(,)? }) => {
        impl $ty {
            $( $crate::setters::setters!(@ $ty $mode $field $t); )*
        }
    };
    (@ $ty:ident value $field:ident $t:ty) => {
        #[doc = concat!("Sets [`", stringify!($ty), "::", stringify!($field), "`].")]
        #[must_use]
        pub fn $field(mut self, value: $t) -> Self {
            self.$field = value;
            self
        }
    };
    (@ $ty:ident into $field:ident $t:ty) => {
        #[doc = concat!("Sets [`", stringify!($ty), "::", stringify!($field), "`].")]
        #[must_use]
        pub fn $field(mut self, value: impl Into<$t>) -> Self {
            self.$field = value.into();
            self
        }
    };
    (@ $ty:ident some $field:ident $t:ty) => {
        #[doc = concat!("Sets [`", stringify!($ty), "::", stringify!($field), "`] (a value, `Some(value)` or `None`).")]
        #[must_use]
        pub fn $field(mut self, value: impl Into<Option<$t>>) -> Self {
            self.$field = value.into();
            self
        }
    };
    (@ $ty:ident fill $field:ident $t:ty) => {
        #[doc = concat!("Sets [`", stringify!($ty), "::", stringify!($field), "`] to `Some(value)`.")]
        #[must_use]
        pub fn $field(mut self, value: $t) -> Self {
            self.$field = Some(value);
            self
        }
    };
    (@ $ty:ident some_into $field:ident $t:ty) => {
        #[doc = concat!("Sets [`", stringify!($ty), "::", stringify!($field), "`] to `Some(value)`.")]
        #[must_use]
        pub fn $field(mut self, value: impl Into<$t>) -> Self {
            self.$field = Some(value.into());
            self
        }
    };
}

pub(crate) use setters;
