//! Element types, in DLPack's terms (`code`, `bits`, `lanes`).

use crate::error::{Error, Result};

/// An element type, laid out like DLPack's `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DevshareDType {
    /// DLPack type code: Int=0, UInt=1, Float=2, Bfloat=4, Complex=5, Bool=6, float8 kinds 7..=14.
    pub code: u8,
    /// Bits per lane (8, 16, 32, 64, 128).
    pub bits: u8,
    /// Lanes per element (1 for every PyTorch dtype).
    pub lanes: u16,
}

/// DLPack type code: signed integer.
pub const DEVSHARE_DTYPE_INT: u8 = 0;
/// DLPack type code: unsigned integer.
pub const DEVSHARE_DTYPE_UINT: u8 = 1;
/// DLPack type code: IEEE float.
pub const DEVSHARE_DTYPE_FLOAT: u8 = 2;
/// DLPack type code: opaque handle (cannot be shared).
pub const DEVSHARE_DTYPE_OPAQUE_HANDLE: u8 = 3;
/// DLPack type code: bfloat16.
pub const DEVSHARE_DTYPE_BFLOAT: u8 = 4;
/// DLPack type code: complex.
pub const DEVSHARE_DTYPE_COMPLEX: u8 = 5;
/// DLPack type code: bool (8 bits).
pub const DEVSHARE_DTYPE_BOOL: u8 = 6;
/// First of DLPack's float8 type codes (e3m4).
pub const DEVSHARE_DTYPE_FLOAT8_FIRST: u8 = 7;
/// Last of DLPack's float8 type codes (e8m0fnu).
pub const DEVSHARE_DTYPE_FLOAT8_LAST: u8 = 14;

/// Short names for the codes inside the crate.
pub mod code {
    pub use super::{
        DEVSHARE_DTYPE_BFLOAT as BFLOAT, DEVSHARE_DTYPE_BOOL as BOOL, DEVSHARE_DTYPE_COMPLEX as COMPLEX,
        DEVSHARE_DTYPE_FLOAT as FLOAT, DEVSHARE_DTYPE_FLOAT8_FIRST as FLOAT8_FIRST,
        DEVSHARE_DTYPE_FLOAT8_LAST as FLOAT8_LAST, DEVSHARE_DTYPE_INT as INT,
        DEVSHARE_DTYPE_OPAQUE_HANDLE as OPAQUE_HANDLE, DEVSHARE_DTYPE_UINT as UINT,
    };
}

impl DevshareDType {
    pub const fn new(code: u8, bits: u8, lanes: u16) -> Self {
        DevshareDType { code, bits, lanes }
    }

    /// Checks that the dtype is one devshare can address byte-wise and returns the element size
    /// in bytes. Sub-byte types (float4, float6) and opaque handles are refused.
    pub fn element_size(&self) -> Result<u64> {
        let ok_bits: &[u8] = match self.code {
            code::INT | code::UINT => &[8, 16, 32, 64],
            code::FLOAT => &[16, 32, 64],
            code::BFLOAT => &[16],
            code::COMPLEX => &[64, 128],
            code::BOOL => &[8],
            code::FLOAT8_FIRST..=code::FLOAT8_LAST => &[8],
            code::OPAQUE_HANDLE => return Err(Error::BadDtype("opaque handles (code 3) cannot be shared".into())),
            other => {
                return Err(Error::BadDtype(format!(
                    "unknown or sub-byte DLPack type code {other} (supported: 0-2, 4-14)"
                )))
            }
        };
        if !ok_bits.contains(&self.bits) {
            return Err(Error::BadDtype(format!(
                "type code {} does not come in {} bits (allowed: {:?})",
                self.code, self.bits, ok_bits
            )));
        }
        if self.lanes == 0 {
            return Err(Error::BadDtype("lanes is 0 (must be at least 1)".into()));
        }
        Ok(u64::from(self.bits / 8) * u64::from(self.lanes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_sizes_of_pytorch_dtypes() {
        assert_eq!(DevshareDType::new(code::FLOAT, 32, 1).element_size(), Ok(4));
        assert_eq!(DevshareDType::new(code::FLOAT, 16, 1).element_size(), Ok(2));
        assert_eq!(DevshareDType::new(code::BFLOAT, 16, 1).element_size(), Ok(2));
        assert_eq!(DevshareDType::new(code::INT, 64, 1).element_size(), Ok(8));
        assert_eq!(DevshareDType::new(code::BOOL, 8, 1).element_size(), Ok(1));
        assert_eq!(DevshareDType::new(code::COMPLEX, 128, 1).element_size(), Ok(16));
        assert_eq!(DevshareDType::new(code::FLOAT, 32, 4).element_size(), Ok(16));
    }

    #[test]
    fn unknown_codes_bits_and_zero_lanes_are_refused() {
        for dt in [
            DevshareDType::new(3, 64, 1),
            DevshareDType::new(17, 4, 1),
            DevshareDType::new(200, 8, 1),
            DevshareDType::new(code::FLOAT, 8, 1),
            DevshareDType::new(code::BOOL, 1, 1),
            DevshareDType::new(code::FLOAT, 32, 0),
        ] {
            assert_eq!(dt.element_size().unwrap_err().status(), crate::Status::BadDtype, "{dt:?}");
        }
    }
}
