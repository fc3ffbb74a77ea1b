//! `Matrix` construction: building into a used buffer, and refusing bad input.

use super::*;

#[test]
fn a_matrix_built_into_a_used_buffer_equals_a_fresh_one() {
    // Streamed experts are built into the ranges evicted experts gave back to the store's slot
    // pool: the last matrix's bytes must not show, not even in the padding rows of a last
    // partial group. So must a `Vec` with leftover bytes (here 0xAB, and larger).
    for dtype in ALL {
        let mut rng = Rng::new(dtype.id() as u64 + 70);
        let (rows, cols) = (19, cols_for(dtype));
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let fresh = Matrix::new(dtype, rows, cols, MatrixBytes::Owned(bytes.clone())).unwrap();
        let len = fresh.resident_bytes();
        let pool = super::weight_buffer::SlotPool::new(u64::MAX);
        let mut used = pool.carve(len);
        used.fill(0xAB);
        let at = used.as_ptr();
        drop(used);
        let in_pool = pool.lend_free(len).expect("the range given back");
        assert_eq!(in_pool.as_ptr(), at, "{dtype}: the range lent again");
        let vec = WeightBuffer::from(vec![0xABu8; len + 100]);
        for buf in [in_pool, vec] {
            let reused =
                Matrix::new_in(dtype, rows, cols, MatrixBytes::Owned(bytes.clone()), buf).unwrap();
            assert_eq!(reused.resident_bytes(), len, "{dtype}");
            for g in 0..rows.div_ceil(matrix::GROUP) {
                assert_eq!(reused.group(g), fresh.group(g), "{dtype} group {g}");
            }
        }
    }
}

#[test]
fn matrix_new_rejects_bad_input() {
    let e = Matrix::new(GgmlType::Q4_0, 2, 33, MatrixBytes::Owned(vec![0; 36]));
    assert!(matches!(e, Err(KernelError::BadCols { .. })));
    let e = Matrix::new(GgmlType::Q4_0, 2, 32, MatrixBytes::Owned(vec![0; 35]));
    assert!(matches!(e, Err(KernelError::BadLength { .. })));
    let e = Matrix::new(GgmlType::Q4K, 1, 256, MatrixBytes::Owned(vec![0; 144]));
    assert!(e.is_ok());
    let buf: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(vec![0u8; 100]);
    let e = Matrix::new(
        GgmlType::F32,
        1,
        20,
        MatrixBytes::Shared {
            bytes: buf,
            offset: 50,
            len: 80,
        },
    );
    assert!(matches!(e, Err(KernelError::BadRange)));
    let e = Matrix::new(GgmlType::F32, usize::MAX, 4, MatrixBytes::Owned(vec![]));
    assert!(matches!(e, Err(KernelError::TooLarge { .. })));
    let e = Matrix::new(GgmlType::F16, 0, 0, MatrixBytes::Owned(vec![]));
    assert!(e.is_err());
}
