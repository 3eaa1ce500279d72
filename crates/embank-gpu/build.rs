//! With the `emulator` feature: the kernels (kernels/cache.cu) compiled for the CPU, as
//! the tests' stand-in for a GPU. Without it: nothing to build (the PTX is embedded).
fn main() {
    println!("cargo:rerun-if-changed=kernels");
    #[cfg(feature = "emulator")]
    cc::Build::new()
        .cpp(true)
        .file("kernels/emu.cpp")
        .flag("-std=c++20")
        .flag("-ffp-contract=off")
        .opt_level(1)
        .warnings(true)
        .compile("embank_gpu_emu");
}
