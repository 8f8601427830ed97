//! Where a tensor lives and where kernels run.

use std::fmt;
use std::str::FromStr;

/// A compute device. It is a plain value: cheap to copy, compare and print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// What the user asked for: a specific device or "whatever works best here".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRequest {
    Auto,
    Exact(Device),
}

impl FromStr for DeviceRequest {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Exact(Device::Cpu)),
            "cuda" => Ok(DeviceRequest::Exact(Device::Cuda(0))),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => Ok(DeviceRequest::Exact(Device::Cuda(i))),
                _ => Err(format!(
                    "unknown device '{s}'; use auto, cpu, cuda or cuda:N (for example cuda:0)"
                )),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_requests_and_rejects_garbage() {
        assert_eq!("auto".parse(), Ok(DeviceRequest::Auto));
        assert_eq!("cpu".parse(), Ok(DeviceRequest::Exact(Device::Cpu)));
        assert_eq!("cuda:3".parse(), Ok(DeviceRequest::Exact(Device::Cuda(3))));
        let err = "gpu0".parse::<DeviceRequest>().unwrap_err();
        assert!(err.contains("cuda:N"), "{err}");
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}
