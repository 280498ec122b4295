// tests/mac/metal_device.swift — is there a real Apple GPU here? Run on macOS
// as a script (`swift tests/mac/metal_device.swift`) by the CI's macOS job
// before `make test`. Lists every Metal device with its name and whether it
// supports the Apple7 and Metal 3 GPU families, then exits 0 when one is a
// real Apple GPU (Apple7 or later, not a paravirtual device: GitHub's arm64
// runners expose "Apple Paravirtual device", on which custom compute kernels
// are not to be trusted), 1 otherwise. The last line says which and why.
import Foundation
import Metal

let devices = MTLCopyAllDevices()
var usable: [String] = []
for device in devices {
    let apple7 = device.supportsFamily(.apple7)
    let metal3 = device.supportsFamily(.metal3)
    let paravirtual = device.name.localizedCaseInsensitiveContains("paravirtual")
    print("metal_device: '\(device.name)' Apple7: \(apple7) Metal3: \(metal3) paravirtual: \(paravirtual)")
    if apple7 && !paravirtual {
        usable.append(device.name)
    }
}
if let name = usable.first {
    print("metal_device: real Apple GPU: \(name)")
    exit(0)
}
print(devices.isEmpty ? "metal_device: no Metal device"
                      : "metal_device: no real Apple GPU (none supports Apple7 without being paravirtual)")
exit(1)
