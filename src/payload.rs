//! Payloads travel through the extension as opaque jsonb datums.
//!
//! pgrx's `JsonB` parses every value into `serde_json::Value` and prints it back, which would
//! cost more than the rest of `produce` and `claim` together. The extension never looks inside a
//! payload, so these types carry the datum as Postgres made it: an argument is handed to SPI as
//! is, and a value read through SPI is detoasted and copied once into the parent of SPI's
//! memory context (the transaction's, for pgrx's atomic connections), which outlives the call's
//! rows: `claim` puts them into its tuplestore (src/srf.rs).

use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::datum::Datum;
use pgrx::nullable::Nullable;
use pgrx::pg_sys;
use pgrx::{FromDatum, IntoDatum};

macro_rules! raw_datum {
    ($(#[$doc:meta])* $name:ident, $oid:expr, $sql:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $name(pg_sys::Datum);

        impl FromDatum for $name {
            unsafe fn from_polymorphic_datum(
                datum: pg_sys::Datum,
                is_null: bool,
                _typoid: pg_sys::Oid,
            ) -> Option<Self> {
                (!is_null).then_some($name(datum))
            }

            unsafe fn from_datum_in_memory_context(
                mut memory_context: pgrx::PgMemoryContexts,
                datum: pg_sys::Datum,
                is_null: bool,
                _typoid: pg_sys::Oid,
            ) -> Option<Self> {
                if is_null {
                    return None;
                }
                // SAFETY: `datum` is a valid varlena of this type (SPI, or src/message/scan.rs,
                // checked the column type);
                // the copy lives as long as `memory_context`.
                memory_context.switch_to(|_| unsafe {
                    let copy = pg_sys::pg_detoast_datum_copy(datum.cast_mut_ptr());
                    Some($name(pg_sys::Datum::from(copy)))
                })
            }
        }

        impl IntoDatum for $name {
            fn into_datum(self) -> Option<pg_sys::Datum> {
                Some(self.0)
            }

            fn type_oid() -> pg_sys::Oid {
                $oid
            }
        }

        // SAFETY (both impls): the datum is passed through unchanged, as `FromDatum` made it.
        unsafe impl<'fcx> ArgAbi<'fcx> for $name {
            unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
                let index = arg.index();
                unsafe {
                    arg.unbox_arg_using_from_datum()
                        .unwrap_or_else(|| panic!("argument {index} must not be null"))
                }
            }

            unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
                unsafe { arg.unbox_arg_using_from_datum().into() }
            }
        }

        unsafe impl BoxRet for $name {
            unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> Datum<'fcx> {
                unsafe { fcinfo.return_raw_datum(self.0) }
            }
        }

        pgrx::impl_sql_translatable!($name, $sql);
    };
}

raw_datum!(
    /// A `jsonb` message payload, never parsed by the extension.
    RawJsonb,
    pg_sys::JSONBOID,
    "jsonb"
);

raw_datum!(
    /// A `jsonb[]` of payloads for batch produce, unnested by SQL.
    RawJsonbArray,
    pg_sys::JSONBARRAYOID,
    "jsonb[]"
);

impl RawJsonbArray {
    /// The elements, in order (`None`: a NULL), as datums pointing into the array, which is
    /// detoasted in the current memory context: they live as long as it does.
    pub fn elements(self) -> Vec<Option<pg_sys::Datum>> {
        let mut elements = std::ptr::null_mut();
        let mut nulls = std::ptr::null_mut();
        let mut count = 0;
        // SAFETY: the datum is a jsonb[] (the function's argument type); deconstruct_array
        // fills the two arrays with `count` entries each.
        unsafe {
            let array = pg_sys::pg_detoast_datum(self.0.cast_mut_ptr()).cast::<pg_sys::ArrayType>();
            pg_sys::deconstruct_array(
                array,
                pg_sys::JSONBOID,
                -1,
                false,
                pg_sys::TYPALIGN_INT as std::ffi::c_char,
                &mut elements,
                &mut nulls,
                &mut count,
            );
            (0..count.max(0) as usize).map(|i| (!*nulls.add(i)).then(|| *elements.add(i))).collect()
        }
    }
}
