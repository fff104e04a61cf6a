//! The token types of an indexed dataset: Megatron-LM's `DType` codes, widths and decoding.

use crate::error::DataError;

/// A token type of an indexed dataset (the integer codes of Megatron-LM's `DType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    U8,
    I16,
    I32,
    I64,
    U16,
    /// Flat token files only: Megatron's index has no code for it.
    U32,
}

impl TokenType {
    /// Megatron's code of this type (none for `U32`).
    pub fn code(self) -> Option<u8> {
        match self {
            Self::U8 => Some(1),
            Self::I16 => Some(3),
            Self::I32 => Some(4),
            Self::I64 => Some(5),
            Self::U16 => Some(8),
            Self::U32 => None,
        }
    }

    /// `uint16` or `uint32`: the token types of a flat token file (`--token-dtype`).
    pub fn parse_flat(name: &str) -> Result<Self, DataError> {
        match name {
            "uint16" => Ok(Self::U16),
            "uint32" => Ok(Self::U32),
            other => Err(DataError::Invalid(format!(
                "token dtype '{other}': a flat token file holds uint16 or uint32 tokens"
            ))),
        }
    }

    /// The type of Megatron's `code`; the float and int8 codes are no token types.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::U8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            8 => Self::U16,
            _ => return None,
        })
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 | Self::U32 => 4,
            Self::I64 => 8,
        }
    }

    /// The smallest type Megatron's tools choose for a vocabulary of `vocab` ids: uint16 below
    /// 65 500, else int32.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab < 65_500 {
            Self::U16
        } else {
            Self::I32
        }
    }

    pub(super) fn decode(self, bytes: &[u8]) -> i64 {
        match self {
            Self::U8 => bytes[0] as i64,
            Self::I16 => i16::from_le_bytes([bytes[0], bytes[1]]) as i64,
            Self::U16 => u16::from_le_bytes([bytes[0], bytes[1]]) as i64,
            Self::U32 => u32::from_le_bytes(bytes.try_into().unwrap_or_default()) as i64,
            Self::I32 => i32::from_le_bytes(bytes.try_into().unwrap_or_default()) as i64,
            Self::I64 => i64::from_le_bytes(bytes.try_into().unwrap_or_default()),
        }
    }

    pub(super) fn encode(self, token: u32, out: &mut Vec<u8>) -> bool {
        match self {
            Self::U8 => u8::try_from(token).map(|t| out.push(t)).is_ok(),
            Self::I16 => i16::try_from(token)
                .map(|t| out.extend(t.to_le_bytes()))
                .is_ok(),
            Self::U16 => u16::try_from(token)
                .map(|t| out.extend(t.to_le_bytes()))
                .is_ok(),
            Self::I32 => i32::try_from(token)
                .map(|t| out.extend(t.to_le_bytes()))
                .is_ok(),
            Self::U32 => {
                out.extend(token.to_le_bytes());
                true
            }
            Self::I64 => {
                out.extend((token as i64).to_le_bytes());
                true
            }
        }
    }
}
