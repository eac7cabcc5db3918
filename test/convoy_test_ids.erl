%% Pids and references of other nodes and incarnations, built from the external
%% format, for tests (the inbound core's, the wire's, the fuzzer's).
-module(convoy_test_ids).

-export([pid/3, ref/3]).

%% @doc A pid of `Node' with the given creation (NEW_PID_EXT).
-spec pid(node(), non_neg_integer(), non_neg_integer()) -> pid().
pid(Node, Id, Creation) ->
    N = atom_to_binary(Node, utf8),
    binary_to_term(<<131, 88, 119, (byte_size(N)), N/binary, Id:32, 0:32, Creation:32>>).

%% @doc A reference of `Node' with the given creation (NEWER_REFERENCE_EXT).
-spec ref(node(), non_neg_integer(), non_neg_integer()) -> reference().
ref(Node, Id, Creation) ->
    N = atom_to_binary(Node, utf8),
    binary_to_term(<<131, 90, 3:16, 119, (byte_size(N)), N/binary, Creation:32, Id:32, 0:32, 0:32>>).
