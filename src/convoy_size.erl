%% @private
%% Is a term "large"? Pure.
%%
%% Deciding must cost a small send almost nothing, so instead of computing the
%% encoded size (`erlang:external_size/1' walks the whole term every time) this walks
%% the term only until its estimated size passes the threshold. The estimate counts
%% binary bytes exactly and 8 bytes for every other word, close to the external
%% format of the terms that make messages large (binaries, long lists, big tuples).
%%
%% `copy_words/2' is a second measure, of the work a local send of a term costs:
%% the words the runtime copies onto the receiver's heap. It too stops at a cap, so
%% checking a term costs at most about the cap, whatever the term's size.
-module(convoy_size).

-export([is_large/2, measure/2, estimate/1, copy_words/2]).

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

%% @doc True when `Term''s estimated size is at least `Threshold' bytes.
-spec is_large(term(), non_neg_integer() | infinity) -> boolean().
is_large(_Term, infinity) -> false;
is_large(_Term, 0) -> true;
is_large(Term, Threshold) -> walk(Term, [], Threshold) =< 0.

%% @doc `{small, EstimatedBytes}' below `Threshold', else `large'; one walk, which
%% stops at the threshold.
-spec measure(term(), non_neg_integer() | infinity) -> {small, non_neg_integer()} | large.
measure(Term, infinity) ->
    {small, estimate(Term)};
measure(_Term, 0) ->
    large;
measure(Term, Threshold) ->
    case walk(Term, [], Threshold) of
        Left when Left > 0 -> {small, Threshold - Left};
        _ -> large
    end.

%% @doc The whole estimate, in bytes.
-spec estimate(term()) -> non_neg_integer().
estimate(Term) -> -walk(Term, [], -1 bsl 62) - (1 bsl 62).

%% Left counts down from the budget; the walk ends early once it reaches zero.
%% Stack holds the parts still to visit: {term, T}, or {tuple, Tuple, NextIndex}
%% (tagged, so no term of the message can pass for a frame).
walk(_T, _Stack, Left) when Left =< 0, Left > -1 bsl 61 -> Left;
walk(T, Stack, Left) when is_bitstring(T) -> pop(Stack, Left - byte_size(T) - ?WORD);
walk([H | T], Stack, Left) -> walk(H, [{term, T} | Stack], Left - ?WORD);
walk(T, Stack, Left) when is_tuple(T), tuple_size(T) > 0 -> pop([{tuple, T, 1} | Stack], Left - ?WORD);
walk(T, Stack, Left) when is_map(T) -> walk(maps:to_list(T), Stack, Left - ?WORD);
walk(_T, Stack, Left) -> pop(Stack, Left - ?WORD).

pop([], Left) -> Left;
pop([{tuple, T, I} | Stack], Left) when I > tuple_size(T) -> pop(Stack, Left);
pop([{tuple, T, I} | Stack], Left) -> walk(element(I, T), [{tuple, T, I + 1} | Stack], Left);
pop([{term, T} | Stack], Left) -> walk(T, Stack, Left).

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
    ?assert(is_large(lists:seq(1, 10000), 65536)),
    ?assertNot(is_large(lists:seq(1, 100), 65536)).

big_tuple_and_map_test() ->
    ?assert(is_large(list_to_tuple(lists:seq(1, 10000)), 65536)),
    ?assert(is_large(maps:from_list([{I, I} || I <- lists:seq(1, 5000)]), 65536)).

measure_test() ->
    ?assertEqual({small, estimate({a, <<"xyz">>})}, measure({a, <<"xyz">>}, 1000)),
    ?assertEqual(large, measure(<<0:8000>>, 1000)),
    ?assertEqual({small, estimate(<<0:8000>>)}, measure(<<0:8000>>, infinity)),
    ?assertEqual(large, measure(a, 0)).

improper_list_test() ->
    ?assertEqual(estimate([a | {b, 1}]), estimate([a | {b, 2}])),
    ?assert(estimate([a | {{p, q, r}, 1}]) > estimate([a | {b, 1}])),
    ?assertNot(is_large([a | {b, 1}], 1000)).

estimate_close_to_external_size_test() ->
    [begin
         E = estimate(T), X = erlang:external_size(T),
         ?assert(E >= X div 2 andalso E =< X * 9)
     end || T <- [<<0:100000/unit:8>>, lists:seq(1, 5000), {a, <<1:800>>, [x, y]}]].

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
