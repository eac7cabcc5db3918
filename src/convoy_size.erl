%% @private
%% How large is a message? Pure.
%%
%% The size of a message is its encoded size, `erlang:external_size/1': what a
%% distribution send of it encodes. That BIF visits the whole term, but in C:
%% on the 2-core machine convoy is developed on it costs about 50 ns for
%% `{event, Id, <<"user-42">>, #{k => Id}}' where a walk in Erlang that stops at
%% the threshold took 250-280 ns, and a binary of any size costs it a constant.
%% For a term made large by many small parts it visits what the send that follows
%% copies or encodes anyway, at a fraction of that send's cost.
%%
%% `copy_words/2' is a second measure, of the work a local send of a term costs:
%% the words the runtime copies onto the receiver's heap. It stops at a cap, so
%% checking a term costs at most about the cap, whatever the term's size.
-module(convoy_size).

-export([is_large/2, measure/2, sized/2, is_small/2, bytes/1, copy_words/2]).

-define(WORD, 8).
%% Binaries up to this many bytes live on the heap and are copied by a send; longer
%% ones are reference-counted and a send copies only a small header.
-define(HEAP_BIN_BYTES, 64).
-define(REFC_BIN_WORDS, 6).
%% A bitstring that is not a whole number of bytes has a sub-binary header too.
-define(SUB_BIN_WORDS, 5).
%% A pid, port or reference: at most this many words (a remote one is the largest).
-define(ID_WORDS, 8).
%% A fun's own words, not counting what it captured.
-define(FUN_WORDS, 8).

%% Every remote send measures its message once.
-compile({inline, [bytes/1, is_small/2]}).

%% @doc True when `Term''s size is at least `Threshold' bytes.
-spec is_large(term(), non_neg_integer() | infinity) -> boolean().
is_large(_Term, infinity) -> false;
is_large(Term, Threshold) -> bytes(Term) >= Threshold.

%% @doc `{small, Bytes}' below `Threshold', else `{large, Bytes}'.
-spec measure(term(), non_neg_integer() | infinity) ->
          {small | large, non_neg_integer()}.
measure(Term, Threshold) ->
    sized(bytes(Term), Threshold).

%% @doc `measure/2' of a term of `Bytes'.
-spec sized(non_neg_integer(), non_neg_integer() | infinity) ->
          {small | large, non_neg_integer()}.
sized(Bytes, Threshold) ->
    case is_small(Bytes, Threshold) of
        true -> {small, Bytes};
        false -> {large, Bytes}
    end.

%% @doc Whether a term of `Bytes' is below `Threshold': a small message.
-spec is_small(non_neg_integer(), non_neg_integer() | infinity) -> boolean().
is_small(Bytes, Threshold) ->
    Threshold =:= infinity orelse Bytes < Threshold.

%% @doc The size, in bytes, of `Term' in the external format.
-spec bytes(term()) -> non_neg_integer().
bytes(Term) -> erlang:external_size(Term).

%% @doc `{ok, Words}' when a local send of `Term' copies at most `Cap' words (by the
%% model below), else `over'. Visits at most about `Cap' words of the term.
%%
%% The model depends only on the term's value, not on how the runtime happens to
%% represent it here, so two nodes holding the same term get the same answer:
%% a cons cell 2 words, a tuple 1 + its size, a map 4 + 2 per pair (4 per pair past
%% 32 pairs), a float 2, a small integer (below 2^59) nothing, a bignum its
%% magnitude's words + 2, a binary of at most 64 bytes 2 + its bytes / 8 (rounded
%% up), a longer one 6 (its data is shared, not copied), 5 more for a bitstring
%% that is not whole bytes, a pid, port or reference 8, a fun 8 plus what it
%% captured; atoms and `[]' nothing. Sharing within a term does not count: a send
%% does not keep it either.
-spec copy_words(term(), integer()) -> {ok, non_neg_integer()} | over.
copy_words(Term, Cap) -> words(Term, [], 0, Cap).

%% W counts up; the walk ends as soon as it passes Cap. Every step visits a term
%% whose words were already counted (as a slot of its parent), so the walk is
%% bounded by the cap. Stack holds frames of this walk only: {term, T},
%% {tuple, Tuple, NextIndex} or {map, Iterator}.
words(_T, _Stack, W, Cap) when W > Cap -> over;
words([H | T], Stack, W, Cap) -> words(H, [{term, T} | Stack], W + 2, Cap);
words(T, Stack, W, Cap) when is_tuple(T) ->
    next([{tuple, T, 1} | Stack], W + 1 + tuple_size(T), Cap);
words(T, Stack, W, Cap) when is_map(T) ->
    next([{map, maps:iterator(T)} | Stack], W + map_words(map_size(T)), Cap);
words(T, Stack, W, Cap) when is_bitstring(T) -> next(Stack, W + bin_words(T), Cap);
words(T, Stack, W, Cap) when is_integer(T), T >= -(1 bsl 59), T < 1 bsl 59 -> next(Stack, W, Cap);
words(T, Stack, W, Cap) when is_integer(T) ->
    next(Stack, W + 2 + erlang:external_size(T) div ?WORD, Cap);
words(T, Stack, W, Cap) when is_float(T) -> next(Stack, W + 2, Cap);
words(T, Stack, W, Cap) when is_pid(T); is_port(T); is_reference(T) ->
    next(Stack, W + ?ID_WORDS, Cap);
words(T, Stack, W, Cap) when is_function(T) ->
    {env, Env} = erlang:fun_info(T, env),
    words(Env, Stack, W + ?FUN_WORDS, Cap);
words(_AtomOrNil, Stack, W, Cap) -> next(Stack, W, Cap).

next(_Stack, W, Cap) when W > Cap -> over;
next([], W, _Cap) -> {ok, W};
next([{term, T} | Stack], W, Cap) -> words(T, Stack, W, Cap);
next([{tuple, T, I} | Stack], W, Cap) when I > tuple_size(T) -> next(Stack, W, Cap);
next([{tuple, T, I} | Stack], W, Cap) -> words(element(I, T), [{tuple, T, I + 1} | Stack], W, Cap);
next([{map, It} | Stack], W, Cap) ->
    case maps:next(It) of
        none -> next(Stack, W, Cap);
        {K, V, It1} -> words(K, [{term, V}, {map, It1} | Stack], W, Cap)
    end.

map_words(N) when N =< 32 -> 4 + 2 * N;
map_words(N) -> 4 + 4 * N.

bin_words(B) ->
    Bytes = byte_size(B),
    Words = case Bytes =< ?HEAP_BIN_BYTES of
                true -> 2 + (Bytes + ?WORD - 1) div ?WORD;
                false -> ?REFC_BIN_WORDS
            end,
    case is_binary(B) of
        true -> Words;
        false -> Words + ?SUB_BIN_WORDS
    end.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

small_is_small_test() ->
    ?assertNot(is_large({hello, self(), <<"abc">>, 123}, 65536)),
    ?assertNot(is_large(anything, infinity)),
    ?assert(is_large(a, 0)).

big_binary_test() ->
    ?assert(is_large(<<0:70000/unit:8>>, 65536)),
    ?assert(is_large({data, <<0:70000/unit:8>>}, 65536)),
    ?assertNot(is_large({data, <<0:1000/unit:8>>}, 65536)).

long_list_test() ->
    ?assert(is_large(lists:seq(1, 30000), 65536)),
    ?assertNot(is_large(lists:seq(1, 100), 65536)).

big_tuple_and_map_test() ->
    ?assert(is_large(list_to_tuple(lists:seq(1, 30000)), 65536)),
    ?assert(is_large(maps:from_list([{I, I} || I <- lists:seq(1, 10000)]), 65536)).

sized_test() ->
    ?assertEqual({small, 999}, sized(999, 1000)),
    ?assertEqual({large, 1000}, sized(1000, 1000)),
    ?assertEqual({small, 1 bsl 40}, sized(1 bsl 40, infinity)),
    ?assert(is_small(0, 1)),
    ?assertNot(is_small(0, 0)).

measure_test() ->
    ?assertEqual({small, bytes({a, <<"xyz">>})}, measure({a, <<"xyz">>}, 1000)),
    ?assertEqual({large, bytes(<<0:8000>>)}, measure(<<0:8000>>, 1000)),
    ?assertEqual({small, bytes(<<0:8000>>)}, measure(<<0:8000>>, infinity)),
    ?assertEqual({large, bytes(a)}, measure(a, 0)).

improper_list_test() ->
    ?assertEqual(bytes([a | {b, 1}]), bytes([a | {b, 2}])),
    ?assert(bytes([a | {{p, q, r}, 1}]) > bytes([a | {b, 1}])),
    ?assertNot(is_large([a | {b, 1}], 1000)).

copy_words_test() ->
    ?assertEqual({ok, 0}, copy_words(atom, 0)),
    ?assertEqual({ok, 0}, copy_words([], 0)),
    ?assertEqual({ok, 2}, copy_words([a], 10)),
    ?assertEqual({ok, 1 + 3 + 2}, copy_words({a, b, 1.0}, 10)),
    ?assertEqual({ok, 20000}, copy_words(lists:seq(1, 10000), 1 bsl 20)),
    ?assertEqual(over, copy_words(lists:seq(1, 10000), 19999)),
    ?assertEqual({ok, 20000}, copy_words(lists:seq(1, 10000), 20000)),
    ?assertEqual(over, copy_words(a, -1)),
    %% a large binary's data is not copied; a small one's is
    ?assertEqual({ok, 6}, copy_words(<<0:8000000>>, 100)),
    ?assertEqual({ok, 10}, copy_words(<<0:512>>, 100)),
    ?assertEqual({ok, 2 + 1 + 5}, copy_words(<<1:3>>, 100)),
    ?assertEqual({ok, 4 + 2 * 2}, copy_words(#{a => 1, b => 2}, 100)),
    ?assertEqual({ok, 2 + 8}, copy_words({self()}, 100)),
    ?assertEqual({ok, 2 + 8}, copy_words([make_ref()], 100)),
    %% what a fun captured counts
    Big = lists:seq(1, 1000),
    F = fun() -> Big end,
    {ok, FW} = copy_words(F, 1 bsl 20),
    ?assert(FW >= 2000).

%% The model does not undercount what a send really copies (erts_debug:flat_size/1
%% counts a binary's header only when it is reference-counted, as does the model).
copy_words_covers_flat_size_test() ->
    Terms = [lists:seq(1, 1000), deep(10000), {a, [1.5, <<"abc">>], #{k => {v}}},
             maps:from_list([{I, [I]} || I <- lists:seq(1, 500)]), [<<0:8000>> | x],
             {1 bsl 300, -(1 bsl 70), 1 bsl 59, 1 bsl 58}, <<1:3>>, <<0:515>>],
    [begin
         {ok, W} = copy_words(T, 1 bsl 30),
         ?assert(W >= erts_debug:flat_size(T))
     end || T <- Terms].

%% The walk stops at the cap: a term of a million cells is checked in no time.
copy_words_stops_at_cap_test() ->
    Huge = deep(1000000),
    {T, over} = timer:tc(fun() -> copy_words(Huge, 1000) end),
    ?assert(T < 10000).

deep(0) -> [];
deep(N) -> [deep(N - 1)].
-endif.
