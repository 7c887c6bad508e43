//! virtio-blk request parsing with the spec's validation (virtio 1.2 §5.2.6).
//!
//! A request is a chain: device-readable descriptors (the 16-byte header,
//! then OUT / DISCARD / WRITE_ZEROES data), then device-writable ones (IN /
//! GET_ID data), and the last byte of the last descriptor is the status.
//! With `VIRTIO_F_VERSION_1` the driver may frame this any way it likes
//! (header and data may share a descriptor), so the parser works on the
//! readable and writable byte streams, not on descriptor counts.
//!
//! Nothing here writes guest memory: [`parse`] only reads (the header and
//! DISCARD segments) and validates, so a rejected chain leaves RAM untouched
//! apart from the status byte the caller writes.

use smallvec::SmallVec;
use thiserror::Error;
use virtio_bindings::virtio_blk as b;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use crate::{GuestMemoryTracked, ID_BYTES, SECTOR_SHIFT, SECTOR_SIZE, status};

/// Size of the request header (`struct virtio_blk_outhdr`).
pub const HEADER_LEN: usize = 16;
/// Size of one DISCARD / WRITE_ZEROES segment.
pub const DISCARD_SEGMENT_LEN: usize = 16;

/// A guest buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Guest physical address.
    pub addr: GuestAddress,
    /// Length in bytes (non-zero).
    pub len: u32,
}

/// A request's buffers: a driver's request has a few (Linux: the header,
/// one per data page run, the status), so they live inline and parsing a
/// request allocates nothing.
pub type Segments = SmallVec<[Segment; 4]>;

/// The request types this device knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    /// Read sectors into guest buffers.
    In,
    /// Write guest buffers to sectors.
    Out,
    /// Make writes durable.
    Flush,
    /// Return the serial.
    GetId,
    /// Deallocate ranges.
    Discard,
    /// Zero ranges.
    WriteZeroes,
}

/// One DISCARD / WRITE_ZEROES range, validated against the capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiscardRange {
    /// First sector.
    pub sector: u64,
    /// Number of sectors (non-zero).
    pub sectors: u32,
    /// WRITE_ZEROES may deallocate.
    pub unmap: bool,
}

/// A validated request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub kind: RequestType,
    /// First sector (IN/OUT).
    pub sector: u64,
    /// Data buffers: device-writable for IN and GET_ID, device-readable for
    /// OUT. Every one lies inside guest memory.
    pub data: Segments,
    /// Total bytes in `data`.
    pub data_len: u64,
    /// Ranges of a DISCARD / WRITE_ZEROES.
    pub ranges: Vec<DiscardRange>,
    /// Where the status byte goes (writable, inside guest memory).
    pub status: GuestAddress,
}

/// What the device supports, for validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Capacity in sectors.
    pub capacity: u64,
    /// DISCARD was offered.
    pub discard: bool,
    /// WRITE_ZEROES was offered.
    pub write_zeroes: bool,
    /// Most sectors per DISCARD / WRITE_ZEROES segment.
    pub max_discard_sectors: u32,
    /// Most segments per DISCARD / WRITE_ZEROES request.
    pub max_discard_seg: u32,
}

/// Why a chain was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RequestError {
    /// The chain has no descriptors.
    #[error("the descriptor chain is empty")]
    Empty,
    /// The chain is longer than the device accepts.
    #[error("the descriptor chain has more than {0} descriptors")]
    TooLong(usize),
    /// The last descriptor is not device-writable, so there is no status byte.
    #[error("the last descriptor is not device-writable, so there is no status byte")]
    StatusNotWritable,
    /// The last descriptor is empty.
    #[error("the last descriptor has length 0, so there is no status byte")]
    StatusEmpty,
    /// The status byte lies outside guest memory.
    #[error("the status byte at {0:#x} lies outside guest memory")]
    StatusOutsideMemory(u64),
    /// A device-readable descriptor follows a device-writable one.
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    /// A buffer lies (partly) outside guest memory.
    #[error("a buffer at {addr:#x} of {len} bytes lies outside guest memory")]
    OutsideMemory {
        /// Start.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// Fewer than 16 device-readable bytes.
    #[error("the request header needs 16 device-readable bytes, the chain has {0}")]
    ShortHeader(u64),
    /// Reading guest memory failed although the range was checked.
    #[error("reading the request from guest memory failed")]
    Read,
    /// Unknown request type.
    #[error("request type {0} is not supported")]
    Unsupported(u32),
    /// Data in the wrong direction for the request type.
    #[error("a {0:?} request carries {1} bytes of data in the wrong direction")]
    WrongDirection(RequestType, u64),
    /// Data length not a multiple of 512.
    #[error("the data length {0} is not a multiple of 512")]
    Unaligned(u64),
    /// Beyond the end of the disk (or overflowing).
    #[error("sectors {sector}+{count} lie beyond the disk's {capacity} sectors")]
    OutOfRange {
        /// First sector.
        sector: u64,
        /// Sectors asked for.
        count: u64,
        /// Capacity.
        capacity: u64,
    },
    /// GET_ID buffer too small.
    #[error("the GET_ID buffer has {0} bytes, it needs 20")]
    ShortIdBuffer(u64),
    /// Malformed DISCARD / WRITE_ZEROES payload.
    #[error("the discard/write-zeroes payload of {0} bytes is malformed")]
    BadDiscard(u64),
    /// Reserved flags set in a DISCARD / WRITE_ZEROES segment.
    #[error("a discard/write-zeroes segment has unsupported flags {0:#x}")]
    DiscardFlags(u32),
    /// A DISCARD / WRITE_ZEROES segment covers too many sectors.
    #[error("a discard/write-zeroes segment covers {0} sectors, more than the device allows")]
    DiscardTooBig(u32),
    /// A write to a read-only device.
    #[error("the device is read-only")]
    ReadOnly,
    /// The host I/O failed.
    #[error("the host I/O failed: {0}")]
    Io(String),
}

/// A refused chain: the status to write (if there is a writable status byte)
/// and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// Where the status byte goes; `None`: the chain is returned with length 0.
    pub status: Option<GuestAddress>,
    /// `VIRTIO_BLK_S_IOERR` or `VIRTIO_BLK_S_UNSUPP`.
    pub code: u8,
    /// Why.
    pub error: RequestError,
}

fn no_status(error: RequestError) -> Rejected {
    Rejected {
        status: None,
        code: status::IOERR,
        error,
    }
}

/// Splits the byte stream `segs` at `at`: the bytes before and after.
fn split_at(segs: &[Segment], mut at: u64) -> (Segments, Segments) {
    let (mut head, mut tail) = (Segments::new(), Segments::new());
    for s in segs {
        let len = u64::from(s.len);
        if at >= len {
            head.push(*s);
            at -= len;
        } else if at == 0 {
            tail.push(*s);
        } else {
            // 0 < at < len <= u32::MAX
            let a = at as u32;
            head.push(Segment { addr: s.addr, len: a });
            tail.push(Segment {
                addr: s.addr.unchecked_add(u64::from(a)),
                len: s.len - a,
            });
            at = 0;
        }
    }
    (head, tail)
}

fn total(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Reads exactly `buf.len()` bytes gathered from `segs` (checked ranges).
pub fn read_gather(mem: &GuestMemoryTracked, segs: &[Segment], buf: &mut [u8]) -> Result<(), RequestError> {
    let mut done = 0usize;
    for s in segs {
        if done == buf.len() {
            break;
        }
        let n = (buf.len() - done).min(s.len as usize);
        mem.read_slice(&mut buf[done..done + n], s.addr)
            .map_err(|_| RequestError::Read)?;
        done += n;
    }
    if done == buf.len() {
        Ok(())
    } else {
        Err(RequestError::Read)
    }
}

/// Parses and validates one chain's descriptors.
pub fn parse(descs: &[Descriptor], mem: &GuestMemoryTracked, limits: &Limits) -> Result<Request, Rejected> {
    // 1. The status byte: the last byte of the last descriptor, writable.
    let Some(last) = descs.last() else {
        return Err(no_status(RequestError::Empty));
    };
    if !last.is_write_only() {
        return Err(no_status(RequestError::StatusNotWritable));
    }
    if last.len() == 0 {
        return Err(no_status(RequestError::StatusEmpty));
    }
    let status_addr = match last.addr().checked_add(u64::from(last.len()) - 1) {
        Some(a) if GuestMemoryBackend::check_range(mem, a, 1) => a,
        _ => return Err(no_status(RequestError::StatusOutsideMemory(last.addr().0))),
    };
    let fail = |code: u8, error: RequestError| Rejected {
        status: Some(status_addr),
        code,
        error,
    };
    let ioerr = |error: RequestError| fail(status::IOERR, error);

    // 2. Readable stream, then writable stream (minus the status byte).
    let mut readable = Segments::new();
    let mut writable = Segments::new();
    let n = descs.len();
    for (i, d) in descs.iter().enumerate() {
        let len = if i + 1 == n { d.len() - 1 } else { d.len() };
        if d.is_write_only() {
            if len > 0 {
                writable.push(Segment { addr: d.addr(), len });
            }
        } else {
            if descs[..i].iter().any(|p| p.is_write_only()) {
                return Err(ioerr(RequestError::ReadableAfterWritable));
            }
            if len > 0 {
                readable.push(Segment { addr: d.addr(), len });
            }
        }
    }
    for s in readable.iter().chain(writable.iter()) {
        if !GuestMemoryBackend::check_range(mem, s.addr, s.len as usize) {
            return Err(ioerr(RequestError::OutsideMemory {
                addr: s.addr.0,
                len: s.len,
            }));
        }
    }

    // 3. The header.
    let rlen = total(&readable);
    if rlen < HEADER_LEN as u64 {
        return Err(ioerr(RequestError::ShortHeader(rlen)));
    }
    let (hdr_segs, out_data) = split_at(&readable, HEADER_LEN as u64);
    let mut hdr = [0u8; HEADER_LEN];
    read_gather(mem, &hdr_segs, &mut hdr).map_err(ioerr)?;
    let req_type = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15]]);
    let out_len = total(&out_data);
    let in_len = total(&writable);

    let kind = match req_type {
        b::VIRTIO_BLK_T_IN => RequestType::In,
        b::VIRTIO_BLK_T_OUT => RequestType::Out,
        b::VIRTIO_BLK_T_FLUSH => RequestType::Flush,
        b::VIRTIO_BLK_T_GET_ID => RequestType::GetId,
        b::VIRTIO_BLK_T_DISCARD if limits.discard => RequestType::Discard,
        b::VIRTIO_BLK_T_WRITE_ZEROES if limits.write_zeroes => RequestType::WriteZeroes,
        other => return Err(fail(status::UNSUPP, RequestError::Unsupported(other))),
    };
    let mut req = Request {
        kind,
        sector: 0,
        data: Segments::new(),
        data_len: 0,
        ranges: Vec::new(),
        status: status_addr,
    };
    let check_range = |sector: u64, count: u64| -> Result<(), Rejected> {
        match sector.checked_add(count) {
            Some(end) if end <= limits.capacity => Ok(()),
            _ => Err(ioerr(RequestError::OutOfRange {
                sector,
                count,
                capacity: limits.capacity,
            })),
        }
    };

    // 4. Per type: direction, alignment, bounds.
    match kind {
        RequestType::In | RequestType::Out => {
            let (data, wrong) = if kind == RequestType::In {
                (writable, out_len)
            } else {
                (out_data, in_len)
            };
            if wrong != 0 {
                return Err(ioerr(RequestError::WrongDirection(kind, wrong)));
            }
            let len = total(&data);
            if !len.is_multiple_of(SECTOR_SIZE) {
                return Err(ioerr(RequestError::Unaligned(len)));
            }
            check_range(sector, len >> SECTOR_SHIFT)?;
            req.sector = sector;
            req.data = data;
            req.data_len = len;
        }
        RequestType::Flush => {
            if out_len + in_len != 0 {
                return Err(ioerr(RequestError::WrongDirection(kind, out_len + in_len)));
            }
        }
        RequestType::GetId => {
            if out_len != 0 {
                return Err(ioerr(RequestError::WrongDirection(kind, out_len)));
            }
            if in_len < ID_BYTES as u64 {
                return Err(ioerr(RequestError::ShortIdBuffer(in_len)));
            }
            req.data = writable;
            req.data_len = in_len;
        }
        RequestType::Discard | RequestType::WriteZeroes => {
            if in_len != 0 {
                return Err(ioerr(RequestError::WrongDirection(kind, in_len)));
            }
            let segs = out_len / DISCARD_SEGMENT_LEN as u64;
            if out_len == 0
                || !out_len.is_multiple_of(DISCARD_SEGMENT_LEN as u64)
                || segs > u64::from(limits.max_discard_seg)
            {
                return Err(ioerr(RequestError::BadDiscard(out_len)));
            }
            let mut raw = vec![0u8; out_len as usize];
            read_gather(mem, &out_data, &mut raw).map_err(ioerr)?;
            for seg in raw.chunks_exact(DISCARD_SEGMENT_LEN) {
                let sector = u64::from_le_bytes([seg[0], seg[1], seg[2], seg[3], seg[4], seg[5], seg[6], seg[7]]);
                let sectors = u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]);
                let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
                let allowed = if kind == RequestType::WriteZeroes {
                    b::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                } else {
                    0
                };
                if flags & !allowed != 0 {
                    return Err(fail(status::UNSUPP, RequestError::DiscardFlags(flags)));
                }
                if sectors == 0 || sectors > limits.max_discard_sectors {
                    return Err(ioerr(RequestError::DiscardTooBig(sectors)));
                }
                check_range(sector, u64::from(sectors))?;
                req.ranges.push(DiscardRange {
                    sector,
                    sectors,
                    unmap: flags & b::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
                });
            }
        }
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;

    const W: u16 = VRING_DESC_F_WRITE as u16;

    fn mem() -> GuestMemoryTracked {
        GuestMemoryTracked::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn limits() -> Limits {
        Limits {
            capacity: 100,
            discard: true,
            write_zeroes: true,
            max_discard_sectors: 64,
            max_discard_seg: 2,
        }
    }

    fn hdr(mem: &GuestMemoryTracked, at: u64, t: u32, sector: u64) {
        mem.write_obj(t, GuestAddress(at)).unwrap();
        mem.write_obj(0u32, GuestAddress(at + 4)).unwrap();
        mem.write_obj(sector, GuestAddress(at + 8)).unwrap();
    }

    fn d(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    #[test]
    fn read_request_any_layout() {
        let m = mem();
        hdr(&m, 0x1000, b::VIRTIO_BLK_T_IN, 3);
        // Header in one descriptor; data and status share the last one.
        let r = parse(&[d(0x1000, 16, 0), d(0x2000, 1025, W)], &m, &limits()).unwrap();
        assert_eq!(r.kind, RequestType::In);
        assert_eq!(r.sector, 3);
        assert_eq!(r.data_len, 1024);
        assert_eq!(r.status, GuestAddress(0x2400));
        // Header split over two descriptors, data in the second.
        hdr(&m, 0x3000, b::VIRTIO_BLK_T_OUT, 99);
        let r = parse(
            &[d(0x3000, 8, 0), d(0x3008, 8 + 512, 0), d(0x5000, 1, W)],
            &m,
            &limits(),
        )
        .unwrap();
        assert_eq!(r.kind, RequestType::Out);
        assert_eq!(
            r.data.as_slice(),
            [Segment {
                addr: GuestAddress(0x3010),
                len: 512
            }]
        );
    }

    #[test]
    fn rejections() {
        let m = mem();
        let l = limits();
        hdr(&m, 0x1000, b::VIRTIO_BLK_T_IN, 0);
        let e = |descs: &[Descriptor]| parse(descs, &m, &l).unwrap_err();
        assert_eq!(e(&[]).status, None);
        assert_eq!(e(&[d(0x1000, 16, 0)]).error, RequestError::StatusNotWritable);
        assert_eq!(e(&[d(0x1000, 16, 0), d(0x2000, 0, W)]).error, RequestError::StatusEmpty);
        assert_eq!(e(&[d(0x1000, 16, 0), d(1 << 20, 1, W)]).status, None);
        assert_eq!(
            e(&[d(0x1000, 16, 0), d(0x2000, 512, W), d(0x3000, 16, 0), d(0x4000, 1, W)]).error,
            RequestError::ReadableAfterWritable
        );
        assert_eq!(
            e(&[d(0x1000, 8, 0), d(0x4000, 1, W)]).error,
            RequestError::ShortHeader(8)
        );
        assert!(matches!(
            e(&[d(0x1000, 16, 0), d(0xff000, 0x2000, W), d(0x4000, 1, W)]).error,
            RequestError::OutsideMemory { .. }
        ));
        assert_eq!(
            e(&[d(0x1000, 16, 0), d(0x2000, 100, W), d(0x4000, 1, W)]).error,
            RequestError::Unaligned(100)
        );
        assert_eq!(
            e(&[d(0x1000, 16 + 512, 0), d(0x4000, 1, W)]).error,
            RequestError::WrongDirection(RequestType::In, 512)
        );
        hdr(&m, 0x1000, b::VIRTIO_BLK_T_IN, u64::MAX);
        assert!(matches!(
            e(&[d(0x1000, 16, 0), d(0x2000, 512, W), d(0x4000, 1, W)]).error,
            RequestError::OutOfRange { .. }
        ));
        hdr(&m, 0x1000, 77, 0);
        let r = e(&[d(0x1000, 16, 0), d(0x4000, 1, W)]);
        assert_eq!((r.code, r.status), (status::UNSUPP, Some(GuestAddress(0x4000))));
        hdr(&m, 0x1000, b::VIRTIO_BLK_T_GET_ID, 0);
        assert_eq!(
            e(&[d(0x1000, 16, 0), d(0x2000, 19, W), d(0x4000, 1, W)]).error,
            RequestError::ShortIdBuffer(19)
        );
    }

    #[test]
    fn discard_segments() {
        let m = mem();
        hdr(&m, 0x1000, b::VIRTIO_BLK_T_WRITE_ZEROES, 0);
        m.write_obj(10u64, GuestAddress(0x1010)).unwrap();
        m.write_obj(8u32, GuestAddress(0x1018)).unwrap();
        m.write_obj(1u32, GuestAddress(0x101c)).unwrap();
        let r = parse(&[d(0x1000, 32, 0), d(0x4000, 1, W)], &m, &limits()).unwrap();
        assert_eq!(
            r.ranges,
            vec![DiscardRange {
                sector: 10,
                sectors: 8,
                unmap: true
            }]
        );
        hdr(&m, 0x1000, b::VIRTIO_BLK_T_DISCARD, 0);
        let r = parse(&[d(0x1000, 32, 0), d(0x4000, 1, W)], &m, &limits()).unwrap_err();
        assert_eq!(r.code, status::UNSUPP, "unmap flag on discard");
        let mut l = limits();
        l.discard = false;
        assert_eq!(
            parse(&[d(0x1000, 32, 0), d(0x4000, 1, W)], &m, &l).unwrap_err().code,
            status::UNSUPP
        );
    }
}
